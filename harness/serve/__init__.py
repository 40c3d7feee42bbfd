"""`moebench serve`, split by job: the OpenAI-style protocol (`protocol`, `stream`), the HTTP app and
command (`app`), the engine core process (`core`) and the front end's handle on it (`client`)."""
