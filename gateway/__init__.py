"""kvmesh.gateway: an OpenAI-compatible HTTP front for real engines (vLLM).

It tokenizes a request once, hashes its prompt as the engines do, routes it
with a coordinator policy over the index the engines' own KV events build,
and forwards the prompt as token ids, so router and engine never tokenize
differently. It imports the shared base and the coordinator's pure parts
(index, policies), never `kvmesh.worker`.
"""
