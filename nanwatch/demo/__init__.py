"""Scenario data for `nanwatch demo`: training runs in real log formats that go wrong.

It ships in the wheel because `nanwatch demo` replays it on any machine; the tests and the
bench build their inputs with it too.
"""
