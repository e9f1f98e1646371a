"""``zerospeed serve``: an OpenAI-compatible HTTP server on zerospeed's inference engine.

Layout: ``protocol`` (request bodies -> SamplingParams, error bodies), ``text`` (detokenisation and
stop strings), ``chat_template`` (the model folder's jinja2 template), ``engine_loop`` (the thread
that owns the engine), ``generation`` (one HTTP request's engine work), ``metrics`` (Prometheus),
``app`` (FastAPI endpoints), ``server`` (``serve()`` and its handle), ``cli`` (the command) and
``tensor_parallel`` (ranks through torchrun).
"""

from zerospeed.config.extras import check as _check_extra

_check_extra("fastapi", "uvicorn", "prometheus_client", feature="zerospeed serve")  # one line, not fastapi's traceback
from zerospeed.inference.serving.server import ServeError, ServerHandle, serve  # noqa: E402

__all__ = ["ServeError", "ServerHandle", "serve"]
