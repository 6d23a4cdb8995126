"""What the gateway reports about requests: Prometheus metrics, OpenTelemetry spans and their
phases, the periodic stats log line, each request's timeline of engine events, and the
per-request observer that feeds them all (``observer.py``)."""
