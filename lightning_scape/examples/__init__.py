"""Applications of the library: the ``lightning-scape demo`` (:mod:`~lightning_scape.examples.demo`) and the
small models, corpora and schedules the demo and the benchmarks train (:mod:`~lightning_scape.examples.workloads`)."""
