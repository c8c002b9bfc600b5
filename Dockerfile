# The embedsite service image (also used once to export the model into the shared volume).
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY requirements*.txt ./
RUN pip install --no-cache-dir -r requirements.txt -r requirements-export.txt -r requirements-test.txt \
 && pip install --no-cache-dir --no-deps -r requirements-nodeps.txt
COPY . .
RUN python protos/generate.py
# Static files collected into the image (WhiteNoise serves them; no volume). DEBUG only for this
# step: settings refuse to load without a secret, which a build must not hold.
ENV DJANGO_STATIC_ROOT=/app/staticfiles
RUN DJANGO_DEBUG=1 python manage.py collectstatic --noinput
# The model is exported into the image, so the service's tokenizer and catalogue entry and Triton's
# model.onnx (copied out by compose's `export` and Kubernetes' init container) come from one build.
# Only the export runs in debug (its settings need no secret); nothing of it stays in the image.
RUN HF_HUB_OFFLINE=1 DJANGO_DEBUG=1 python manage.py export_model --if-missing --version 1
EXPOSE 8080
