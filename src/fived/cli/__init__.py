"""The `fived` command line: a thin adapter that parses flags into a Config and calls the API, launcher or tools."""
