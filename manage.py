#!/usr/bin/env python
"""Django's command-line utility; with DATA_DIR exported it talks to that running stack."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "webapp.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
