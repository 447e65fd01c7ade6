from __future__ import annotations

import os

from django.conf import settings
from django.core.asgi import get_asgi_application

from webapp.bodylimit import BodySizeLimit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
django_application = get_asgi_application()
if settings.WEB_WARM_UP:  # the embedding model, before the first question
    from webapp.documents.embeddings import warm_up_in_background

    warm_up_in_background()
# Bodies over the limit are refused as they arrive (Django would first read them whole); the
# knowledge delivery API's JSON has a smaller limit of its own.
application = BodySizeLimit(
    django_application,
    settings.MAX_REQUEST_BYTES,
    path_limits={"/kdn/": settings.KDN_MAX_BODY_BYTES},
)
