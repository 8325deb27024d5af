"""The VLLMDataParallel API: spec and status models, the rule table, the CRD, names, quantities."""
