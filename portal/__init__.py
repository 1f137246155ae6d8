from importlib.util import find_spec

# The `hangar` CLI (portal.cli) may be installed without the server's
# dependencies; only a server process needs the Celery app.
if find_spec("celery") is not None:
    from portal.celery import app as celery_app

    __all__ = ["celery_app"]
