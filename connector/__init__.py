"""kvmesh as a vLLM engine's KV cache: the KV connector and the store beside the engine.

`kvmesh.connector.vllm_connector.KVMeshConnector` is loaded by vLLM
(``--kv-transfer-config`` with ``kv_connector_module_path``) and imports
vLLM; everything else here imports only the base and the proto, so the
store launcher and the block seal run in kvmesh's own venv too. The store
itself is a worker (`kvmesh.worker.engine_store`), started as a process.
"""
