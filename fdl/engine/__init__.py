"""The El Che engine."""
