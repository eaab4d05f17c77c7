"""Serving a decider checkpoint over HTTP: ``POST /v1/decide``, ``GET /healthz``, ``GET /v1/model``.

- :mod:`hobson.serve.questions`: a request body -> corpus rows, or one error naming the field.
- :mod:`hobson.serve.batching`: the bounded queue and the worker that answers questions from
  concurrent requests in shared forwards, grouped by length, under ``--max-batch-tokens``.
- :mod:`hobson.serve.app`: the Starlette application (limits, auth, status codes).
- :mod:`hobson.serve.client`: what ``ask --server`` uses (the standard library alone).

The answers are those of ``ask`` and ``jobs.evaluate``: the same rendering, the same head, the
checkpoint's calibrated temperature per kind, whatever batch a question lands in.
"""
