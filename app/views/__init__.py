"""View builders: `build_<thing>_view(loaded, ...) -> schemas.<Thing>View`.

The one place that calls circuits_core and turns tensors into lists. Builders are synchronous and
blocking; routers (API and pages) call them through `app.scheduling.compute`, never directly on the event
loop. One builder serves a page and its JSON twin.
"""
