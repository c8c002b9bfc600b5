"""Observability: request ids and the request's log context, JSON or text logs, OpenTelemetry traces."""
