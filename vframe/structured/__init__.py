"""Built-in structured-output backends (plugins of kind ``structured_output``).

``guidance``: llguidance, a Rust grammar engine with Python wheels and no
dependencies (JSON schema, regex, choice, Lark and GBNF grammars). It is an
optional dependency: ``pip install 'vframe[structured]'``.
"""
