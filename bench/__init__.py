"""nanwatch's benchmark suite: `make bench` (``python -m bench``), see bench/__main__.py.

Sections: CLI start-up, catch-up scan throughput against grep, msprobe CSV ingestion, live
latency (inotify, polling, Slack), the daemon's idle and loaded cost, and read-side queries
on a million events. Inputs are generated on the spot; nothing here is part of `make test`.
"""
