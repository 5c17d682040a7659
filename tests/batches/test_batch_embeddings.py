"""An embeddings batch on the real MiniLM: each line's vector equals the direct request's."""

from __future__ import annotations

import numpy as np
import pytest

from tests.api.test_embeddings_server import serve_embedder
from tests.support.batches import download, serving, submit, team_client, wait_for

MODEL = "all-MiniLM-L6-v2"
TEXTS = ["The capital of France is Paris.", "a"]


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_an_embeddings_batch_equals_direct_requests(minilm, make_gateway, tmp_path):
    with serving(make_gateway(), tmp_path) as http:
        serve_embedder(http.app, minilm)
        client = team_client(http)
        lines = [
            {
                "custom_id": f"e{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": MODEL, "input": text, "encoding_format": "float"},
            }
            for i, text in enumerate(TEXTS)
        ]
        batch = wait_for(client, submit(client, lines, endpoint="/v1/embeddings").id, timeout=60)
        assert batch.status == "completed" and batch.request_counts.completed == 2, batch
        vectors = {
            o["custom_id"]: o["response"]["body"]["data"][0]["embedding"]
            for o in download(client, batch.output_file_id)
        }
        for i, text in enumerate(TEXTS):
            direct = client.embeddings.create(model=MODEL, input=text, encoding_format="float").data[0].embedding
            assert np.allclose(vectors[f"e{i}"], direct, atol=1e-6)
