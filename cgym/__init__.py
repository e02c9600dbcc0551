"""`cgym`, the command line: the top of the import graph (it may import every other package; none imports it)."""
