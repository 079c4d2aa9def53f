"""The OpenAI-compatible HTTP front of the control plane (FastAPI + uvicorn).

``app.create_app`` builds the routes over the same registry, router and worker pool objects the
gRPC servicer uses (never a gRPC call to ourselves); ``server.HttpServer`` runs uvicorn on its
own thread beside the gRPC server. Modules: ``errors`` (OpenAI's error JSON and the status
table), ``schemas`` (request bodies and the unsupported-parameter rules), ``models`` (``model``
→ adapter map), ``chat_template`` (jinja2), ``generation`` (request → GenerateRequest → response
bodies and server-sent events).
"""
