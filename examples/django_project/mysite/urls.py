from django.urls import path

from mysite import views

urlpatterns = [
    path("complete", views.complete),
    path("chat", views.chat),
]
