"""qkov web app: FastAPI JSON API and htmx dashboard over circuits_core (see app/main.py)."""
