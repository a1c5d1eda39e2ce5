"""The ``vintage`` command line (``vintage_cli.main:app``): the top layer. It may import every other
package (``trainer``, ``benchmarks``, ...); no package imports it."""
