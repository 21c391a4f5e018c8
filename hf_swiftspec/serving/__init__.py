"""Serving: a pair behind transformers' OpenAI-compatible server (`swiftspec serve`).

server.py (the app and the model manager), batching.py (the managers that hand each request to generate(): one
at a time, or every request in one speculating running batch), routing.py (a pair that cannot batch: alone it
speculates, beside others it joins the target's batch), request_settings.py (each request's own settings). The
command line (cli/) only parses `swiftspec serve`'s options; the decoder never imports this package.
"""
