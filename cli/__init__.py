"""timeslice.cli: the `timeslice` command, the composition root.

Only this package (and the demo in it) wires components together; each subcommand
parses flags, builds one config object and starts the component.
"""

