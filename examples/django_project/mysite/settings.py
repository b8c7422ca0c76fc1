"""Settings of the example project: the minimum for async views, plus ASYNCLLM."""

SECRET_KEY = "example-only-not-secret"
DEBUG = True
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
ROOT_URLCONF = "mysite.urls"
INSTALLED_APPS: list[str] = []
MIDDLEWARE: list[str] = []

# EngineConfig fields for asyncllm.integrations.django.get_engine(); no "model": the bundled tiny model.
ASYNCLLM = {"max_num_seqs": 32, "disable_log_stats": True}
