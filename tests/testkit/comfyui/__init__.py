"""The integration suite's harness for a real ComfyUI: the server subprocess and its client
(server.py), the websocket client (ws_client.py), the test-only node pack copied into the
server's custom_nodes (helper_nodes.py, never imported here) and the prompt builder and
checks the sampler tests share (prompts.py)."""
