"""One router per resource: chat, completions, responses (+ conversations), sessions, health (+
models, metrics). Routes are thin: they check the request, build the job, and shape the answer."""
