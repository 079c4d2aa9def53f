"""The OpenAI-compatible HTTP front of the control plane (FastAPI + uvicorn).

``app.create_app`` builds the routes over the same registry, router and worker pool objects the
gRPC servicer uses (``deps.HttpDeps``; never a gRPC call to ourselves); ``server.HttpServer``
runs uvicorn on its own thread beside the gRPC server, its connections guarded by
``connections`` (caps, request-head deadlines). Modules:

* routes: ``models`` (``GET /v1/models`` and ``model`` → adapter map), ``completions``
  (completions and chat), ``admin`` (LoRA load / unload), ``health`` (health and metrics,
  also as the ``--metrics-addr`` listener's app);
* ``schemas`` (request bodies and the unsupported-parameter rules), ``chat_template`` (jinja2);
* ``generation`` (request → GenerateRequest, call context, event folding), ``streaming``
  (events → full JSON body or server-sent events), ``responses`` (OpenAI's object shapes);
* ``errors`` (OpenAI's error JSON, the status table, the app's error handlers).
"""
