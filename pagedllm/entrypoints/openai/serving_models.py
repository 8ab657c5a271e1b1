"""The served model names: `/v1/models`, and the 404 for a request naming a model not served."""

from __future__ import annotations

from http import HTTPStatus

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList


class OpenAIServingModels:
    def __init__(self, served_model_names: list[str] | tuple[str, ...], root: str, max_model_len: int) -> None:
        if not served_model_names:
            raise ValueError("at least one served model name is needed.")
        self.served_model_names = list(served_model_names)
        self.root = root
        self.max_model_len = max_model_len

    def show_available_models(self) -> ModelList:
        return ModelList(
            data=[ModelCard(id=name, root=self.root, max_model_len=self.max_model_len) for name in self.served_model_names]
        )

    def resolve(self, requested: str | None) -> str:
        """The name to answer with: the requested one if served (None means the first), else 404."""
        if requested is None:
            return self.served_model_names[0]
        if requested in self.served_model_names:
            return requested
        raise APIError(
            f"The model `{requested}` does not exist. Served models: {', '.join(self.served_model_names)}.",
            HTTPStatus.NOT_FOUND,
            param="model",
            code="model_not_found",
        )
