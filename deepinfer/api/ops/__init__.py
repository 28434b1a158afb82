"""Operations: Prometheus metrics, the live stats and `/v1/stats`, and the web pages (`web/`)."""
