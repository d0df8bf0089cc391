"""kv_content"""
