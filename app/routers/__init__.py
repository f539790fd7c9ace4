"""The app's routers, plain modules included by app/main.py's create_app:

- api: the listing routes under /api/v1 (models, unavailable models, one model);
- analyses: the API route and page of every declared analysis (app/catalog.py), generated;
- pages: the models page and a model's overview (plain routes), and PAGES, every page (declared_pages: those the
  analyses declare);
- rendering: templates, full page or htmx fragment, the page frame;
- docs: the self-contained API docs at /docs.
"""
