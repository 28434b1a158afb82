"""HTTP plumbing below every route: errors and their envelopes, body reading and deadlines, SSE
framing, API keys and cache salts, refused fields, connections, the access log."""
