"""The terminal, as every command line in the package meets it (click and rich): settings as
flags with their help, one-line errors and exit codes, and how results are printed."""
