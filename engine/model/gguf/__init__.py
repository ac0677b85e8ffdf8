"""GGUF files as models: read and check (``reader``), metadata to a Hugging Face config
(``config``), tensor names and layouts to the checkpoint names our model files map
(``tensors``), and a ``.gguf`` ``--model`` resolved into a folder the server and workers load
(``folder``)."""
