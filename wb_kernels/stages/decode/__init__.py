"""Stage 07: decoding with a KV cache — split-KV (flash-decoding), GQA/MQA and a paged cache (lesson 07_decode).

Under construction: the folder's files are listed here as they land.
"""
