"""Fixtures for tests, scripts, benchmarks and users: random operator inputs (``inputs``),
one-node graphs (``graphs``), small decoders in the structure of Phi-3-small exports
(``decoder_models``), feeds for any model (``feeds``) and the plain-ORT baseline
(``plain_ort``). The runtime wings never import it; the CLI and the benchmarks do.
"""
