"""The pipeline that runs the stages, and the service around it.

``pipeline.Pipeline`` follows paths (``scan`` once, ``watch`` live) through a pass loop
(``passes``) composed of the ``router`` (which reader a file goes to), the ``committer`` (offsets,
events and metrics in one transaction) and the ``run_identity`` (runs, launches, cluster
labels). ``service`` is `watch` under systemd (readiness, watchdog, signals, retention) and
``prometheus`` its ``/metrics`` endpoint.
"""
