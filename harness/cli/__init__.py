"""Commands: the typer app (`app`), options shared by several commands (`options`) and the thin command
modules of the smaller commands. Importing anything here stays light: `moebench --help` imports all of it."""
