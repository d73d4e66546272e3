"""Integrations that run inside the training process (they import their framework themselves).

``nanwatch.integrations.mmengine``: ``NanwatchHook`` for mmengine / mmdet 3.x runners. The
daemon never imports this package; the framework-free API is ``nanwatch.probe``.
"""
