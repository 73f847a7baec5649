"""fdl's command line: thin Typer commands that parse, call the library and render."""
