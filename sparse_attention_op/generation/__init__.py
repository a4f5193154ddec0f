"""Running a decoder: the greedy/sampling loop over an ONNX Runtime session (``loop``), the
ORT GenAI folder it can be prepared into (``genai``) and how a model path is resolved
(``model_files``). It stands on ``ort``.
"""
