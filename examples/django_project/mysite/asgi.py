"""ASGI entry point: `uvicorn mysite.asgi:application` (one event loop per process, as the engine needs)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mysite.settings")
application = get_asgi_application()
