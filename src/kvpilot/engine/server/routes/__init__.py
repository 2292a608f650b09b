"""The HTTP routes, one ``fastapi.APIRouter`` per module; no module imports another."""
