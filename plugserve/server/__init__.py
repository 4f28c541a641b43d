"""The HTTP server: FastAPI app (`app.py`), OpenAI protocol models (`protocol.py`), launch (`launch.py`)."""
