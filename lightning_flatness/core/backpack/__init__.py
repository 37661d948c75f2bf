"""The only part of the package that imports BackPACK: the ``dense`` and ``gram`` structures
(exact P × P and kernel matrices from BackPACK's square-root factors) and their backend. It is
imported only when one of those structures is measured."""
