from __future__ import annotations

import os

from django.conf import settings
from django.core.asgi import get_asgi_application

from webapp.bodylimit import BodySizeLimit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
django_application = get_asgi_application()
# Bodies over the limit are refused as they arrive (Django would first read them whole).
application = BodySizeLimit(django_application, settings.MAX_REQUEST_BYTES)
