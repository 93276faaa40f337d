"""The laboratory: how the evidence in results/ was made (rows, the vmapped seeds harness, the
story search, the tables and figures, early warning). Run from the repository root:
`python -m lab.experiments --help`. Nothing at the top level imports from here."""
