#!/usr/bin/env python
"""Django's command-line utility for the example project.

Run it with an ASGI server so async views share one event loop (and one engine):
    cd examples/django_project && uvicorn mysite.asgi:application
    curl -N 'http://127.0.0.1:8000/complete?prompt=def%20main():'
"""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mysite.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
