"""The gateway's OpenAI-compatible HTTP API (aiohttp, in the gateway's event loop, next to gRPC).

Each route translates its OpenAI body into a ``pb.GenerateRequest`` and runs it through the same
call path as the gRPC Generate (``pipeline/generate_call.py``); only the shapes differ.
"""
