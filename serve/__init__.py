"""kvstore_serve: `kvstore serve`, the session service over HTTP.

An API process (FastAPI + uvicorn: `app.py`, the routers in `routes/`) that never runs the model,
and engine processes (`engine.py`) that hold it, joined by pipes (`pool.py`). The API checks who
asks (`tenants.py`), what is asked (`protocol.py`) and how much (`admission.py`), and turns the
engine's events into OpenAI's responses and server-sent events (`streams.py`); `metrics.py`
declares the Prometheus metrics, `failures.py` maps every library error to an OpenAI-shaped 4xx.

It uses the library's public API only (`kvstore/__init__.py`), like the CLI; pyproject.toml's
import-linter contracts check that.
"""
