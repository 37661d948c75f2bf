"""The Lightning layer: the callbacks (:class:`FlatnessMonitor` watches,
:class:`SoftRankRegularizer` changes training), what they read off the ``Trainer``, the
TensorBoard figures, the bundled module and data, and the command line."""
