"""``python -m fdl`` runs the command line."""

from fdl.cli.main import main

if __name__ == "__main__":
    main()
