"""The OpenAI-compatible server (``vframe serve``); see docs/serving.md.

Modules: ``api_server`` (app, middleware, ``run_server``), ``protocol`` (the wire
format), ``completions`` and ``chat`` (the two generation endpoints),
``serving`` (what they share), ``tools`` (tool_choice and the calls in a reply)
and ``tool_parsers`` (the ``tool_parser`` plugins), ``errors`` (OpenAI's error
shape), ``metrics`` (Prometheus), ``args`` (command-line flags).
"""
