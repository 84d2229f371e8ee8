"""The API's edge: the HTTP server and its protocol limits (http.py), the app and its routes (app.py), the
control socket (admin.py). It hands each body to the answer path (services/api/answer/) or to a feature's API."""
